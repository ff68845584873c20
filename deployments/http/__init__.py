"""The coordinator's HTTP side: request bodies and errors (``bodies``), the routes (``routes``), the try-it page
(``page``, ``web/``), API keys (``api_keys``) and the LoRA adapters loaded at run time (``adapters``)."""
