"""Revision scripts (this file only makes the folder a package so that it is installed)."""
