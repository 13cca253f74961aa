"""What both processes share and nothing else: the contract, shared types and codecs, errors, security, launching."""
# It imports neither `executor_service` nor `scheduler` nor `models`, and never torch: the scheduler stays
# torch-free by importing only this package (tests/contract/test_import_boundaries.py checks both).
