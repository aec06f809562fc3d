"""The request plane (being moved here); see plane.py."""
