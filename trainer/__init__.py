"""loom's PyTorch trainer: runnable on its own, talks to the platform over HTTP only."""
