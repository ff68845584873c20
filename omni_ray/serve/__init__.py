"""The Ray Serve layer: the app builder, the coordinator ingress, the three stage deployments (thin shims over
their engines) and the stage protocol over their handles. Besides the client's handle calls, the only code that
imports Ray."""
