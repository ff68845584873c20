"""The Ray Serve layer of omni-ray: the app builder (``app``), the ``CrossEngineCoordinator`` ingress
(``coordinator``), one deployment per stage (``encoder``, ``dit``, ``vae``, over ``stage``), the stage protocol on
their handles with the step stream's wire format (``stages``), the HTTP side (``http/``) and Serve's policies
(``routing``, ``autoscaling``, ``metrics``). The only code that imports Ray, besides the Python client's Ray
transport."""
