"""shardc.testing: running code on several local gloo processes (torch only)."""
