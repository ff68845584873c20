"""The Ray Serve layer: one thin deployment per stage engine, the coordinator ingress, and the app builder."""
