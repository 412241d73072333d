"""Build a tiny random-weight Llama with a locally trained tokenizer, without any download.

Nothing can be fetched from a model hub on the machines this project targets, and tests
and the README demo need a real model that vLLM serves. The tokenizer is a byte-level BPE
trained on the Python standard library's own sources (always on disk, deterministic once
sorted); the weights are drawn from a fixed seed. Shapes respect vLLM's CPU attention
(head_dim 32 is supported, 16 is not).

    python -m vllm_piep.tools.tiny_model --out .cache/tiny-llama
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + ': ' + message['content'] + '</s>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant: ' }}{% endif %}"
)

_STAMP = "piep_tiny_model.json"


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Architecture of the tiny model; every field ends up in config.json."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 2048
    seed: int = 0
    corpus_files: int = 60

    def digest(self) -> str:
        return _digest(self)


def _corpus(n_files: int) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())[:n_files]
    if not files:
        raise RuntimeError(f"no Python sources found under {stdlib} to train the tokenizer on")
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def _train_tokenizer(spec: TinyLlamaSpec, out: Path) -> tuple[int, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.corpus_files), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tok.token_to_id("<s>"), tok.token_to_id("</s>")


def _save_model(spec: TinyLlamaSpec, out: Path, bos: int, eos: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def _digest(spec: object) -> str:
    return hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:16]


def _is_built(out: Path, digest: str) -> bool:
    """Whether `out` holds a completed build of the spec with this digest."""
    try:
        return json.loads((out / _STAMP).read_text()).get("digest") == digest
    except (OSError, json.JSONDecodeError):
        return False  # no stamp, or a broken one (a broken build): rebuild


def build(out: Path, spec: TinyLlamaSpec | None = None, force: bool = False) -> Path:
    """Build the model into `out`; reuse it when a build of the same spec is already there."""
    spec = spec or TinyLlamaSpec()
    out = Path(out)
    stamp = out / _STAMP
    if not force and _is_built(out, spec.digest()):
        return out
    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    bos, eos = _train_tokenizer(spec, out)
    _save_model(spec, out, bos, eos)
    # Written last: its presence means the whole build completed.
    stamp.write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=2))
    return out


@dataclass(frozen=True)
class TinyMoeSpec:
    """A tiny random Qwen3-MoE (8 experts, top-2) sharing the tiny Llama's tokenizer."""

    hidden_size: int = 128
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0

    def digest(self) -> str:
        return _digest(self)


def build_moe(out: Path, tokenizer_from: Path, spec: TinyMoeSpec | None = None) -> Path:
    """A tiny random Qwen3-MoE into `out`, with the tokenizer of the tiny Llama at
    `tokenizer_from` (built if absent); reused when a build of the same spec is there."""
    spec = spec or TinyMoeSpec()
    out, stamp = Path(out), Path(out) / _STAMP
    if _is_built(out, spec.digest()):
        return out
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    base = build(tokenizer_from)
    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    llama = json.loads((base / "config.json").read_text())
    fields = {k: v for k, v in asdict(spec).items() if k != "seed"}
    config = Qwen3MoeConfig(vocab_size=llama["vocab_size"], intermediate_size=256,
                            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                            bos_token_id=llama["bos_token_id"],
                            eos_token_id=llama["eos_token_id"], tie_word_embeddings=False,
                            torch_dtype="float32", **fields)
    torch.manual_seed(spec.seed)
    Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument("--moe", type=Path, metavar="LLAMA_DIR",
                        help="build the tiny Qwen3-MoE instead, with the tokenizer of the tiny "
                             "Llama in LLAMA_DIR")
    args = parser.parse_args(argv)
    path = build_moe(args.out, args.moe) if args.moe else build(args.out, force=args.force)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
