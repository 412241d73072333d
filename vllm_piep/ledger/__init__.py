"""The billing ledger: every request's energy, with its tenant, kept durably by the API server
(`ledger` option; `runtime/api_server/outputs.py` starts the writer) and read by
`python -m vllm_piep.ledger`. No vLLM imports. docs/billing.md shows the flow end to end."""
