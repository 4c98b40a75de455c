"""The model runner: the forward and sampling of one step plan."""
