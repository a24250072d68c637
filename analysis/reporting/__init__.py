"""What users read: the HTML report, its plots and the terminal summary."""
