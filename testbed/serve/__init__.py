"""``testbed serve``: an OpenAI-compatible front door to the emulated datacenters.

``server`` runs it (network, workers, the serving thread, saving on stop); ``app`` holds
the HTTP endpoints; ``openai_api`` the request and response shapes; ``gateway`` turns a
request into a token stream over the control plane; ``metrics`` is ``/metrics``; ``record``
saves the served requests as a run; ``compare`` sets an external client's measurement
beside the server's.
"""
