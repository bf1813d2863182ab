"""Tools around the backend: the `dvabatch` command line, the `tritonserver` launcher, the demo."""
