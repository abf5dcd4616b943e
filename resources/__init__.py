"""Icons and stylesheets."""
