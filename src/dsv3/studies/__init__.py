"""Numerical studies behind the paper's claims: each one a command of `dsv3 study`."""
