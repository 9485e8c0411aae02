"""Benchmarks inside the engines: SGLang's, LMCache's and vLLM's own code over hicache against
their own storage, and the page-cache floor both store sides are judged by."""
