"""DFlash2: a DFlash block drafter with dynamic causal convolutions in its layers and a candidate selector."""
