"""Prompt data: JSONL / Parquet / built-in task rows -> tokenized prompts, split, and the resumable sampler."""
