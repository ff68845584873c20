"""The caller's side of omni-ray: the images API's request schema and planning, input and output image files,
responses and streamed events, and the Python client. Nothing here imports torch, model code or Ray (the client
imports Ray only when asked to call a deployment handle)."""
