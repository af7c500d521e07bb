"""The embedded Ray's traces on this machine: its start cut short by Ctrl-C, its session folder, its token."""
