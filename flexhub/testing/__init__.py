"""flexhub.testing: the conformance kit for backend packages (see the README)."""
