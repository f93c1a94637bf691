"""Small torch-free helpers: JSON text other tools read, lazy package exports, importing a
user's module by path or name."""
