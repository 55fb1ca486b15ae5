"""Test-only code shared by the test modules: nothing in src/ exists only for tests.

tests/conftest.py puts tests/ on sys.path, so every test module (and the ranks that
`helpers.launch.run_ranks` forks: its forkserver starts with the parent's sys.path) imports these as
`helpers.<module>`:

  launch    run a function on N gloo ranks from a preloaded forkserver
  whole     a parameter whole or local, DTensor or not
  hf_tiny   tiny random Hugging Face causal LMs
  disk      a small tmpfs (a real full disk)
  paths     the repository's root
"""
