"""The test suite (a regular package, so that no stray top-level ``tests`` package a dependency
installs, such as cufile-python's, shadows it in the child processes the tests start)."""
