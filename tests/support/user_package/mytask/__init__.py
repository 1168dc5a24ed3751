"""A small regression task of the user's own package, trained by the lab."""
