"""``specserve bench``: throughput and latency of specserve, with speculation on and off, optionally side by
side with Hugging Face transformers ``generate`` on the same model and prompts, in one process."""
