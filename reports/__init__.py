"""PDF report generation and scheduled reports."""
