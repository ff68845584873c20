"""omni-ray: Qwen-Image served as three engine-backed stages on Ray Serve."""

__version__ = "0.1.0"
