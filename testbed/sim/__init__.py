"""The virtual-time engine (``--engine sim``): the deployment's own code in simulated time."""
