"""Model runners, one per stage: encode (prompt embeddings), denoise (the DiT), decode (the VAE).

They hold the model code and nothing else: no queues, no scheduling, no Ray.
"""
