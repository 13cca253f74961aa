"""Other projects' generated contracts Tandem serves, pinned to a named version."""
