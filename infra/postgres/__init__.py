"""The PostgreSQL database backend: Django's, with cheaper health checks of pooled connections."""
