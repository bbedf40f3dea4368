"""kvpolicy."""
