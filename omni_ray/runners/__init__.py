"""Model runners, one per stage (the tokenizer and vLLM encoder, the DiT, the VAE) and the simulated ones: model
code only, no queues, no scheduling, no Ray, no engine."""
