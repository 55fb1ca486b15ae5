"""Test-only code shared by the test modules: nothing in src/ exists only for tests.

tests/conftest.py puts tests/ on sys.path, so every test module (and the ranks that
`helpers.launch.run_ranks` forks: its forkserver starts with the parent's sys.path) imports these as
`helpers.<module>`:

  launch         run a function on N gloo ranks from a preloaded forkserver
  whole          a parameter whole or local, DTensor or not
  runs           training runs stopped after step k as SIGTERM does, and their losses and checksums
  plan_accuracy  the real side of the planner accuracy tests (tracker peaks of the trainer's step)
  qlora          the tiny HF llama, overrides and one-process reference of the QLoRA tests
  hf_tiny        tiny random Hugging Face causal LMs
  packing        best-fit packing as lists of sample indices
  disk           a small tmpfs (a real full disk)
  paths          the repository's root
"""
