"""The engine: requests, scheduler, paged KV cache, model runner, sampler."""
