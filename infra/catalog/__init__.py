"""The images' bases, read from the Dockerfiles: pure, and imports nothing of ours."""
