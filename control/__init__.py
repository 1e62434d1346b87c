"""The control plane: the router, a runtime process of its own (beside ``workers/``), and what
it keeps about the workers and the requests it routed. It executes a policy
(``testbed/policies``) and speaks only what ``protocol/`` defines."""
