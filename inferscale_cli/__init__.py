"""The ``inferscale`` command line (``main.py``): above both the engine (``inferscale_jax``) and
the HTTP server (``serving``), which it is the one place to join; neither imports it."""
