"""Who may do what: MongoDB roles for each part, read tokens for the dashboard's links, and
field encryption of params and results. Pure rules; the web's face is in ``mtask.web``."""
