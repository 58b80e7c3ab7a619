"""Email sending and campaigns."""
