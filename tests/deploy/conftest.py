"""These tests read files and parse command lines: no torch, no servers."""
