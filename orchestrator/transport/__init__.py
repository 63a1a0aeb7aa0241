"""Ways of reaching a node's agent: see base.NodeConnection."""
