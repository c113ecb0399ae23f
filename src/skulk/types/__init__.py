"""Pure data shared by every part of Skulk. Imports nothing else of the project."""
