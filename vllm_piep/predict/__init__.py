"""Serve-time prediction: the predictor interface, the analytic prior, the split per request."""
