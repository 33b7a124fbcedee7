"""Example models served by microbatch."""
