"""What the notebooks show: figures (`plots`) and environment tables, parity figures and metrics (`report`)."""
