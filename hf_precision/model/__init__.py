"""What the model is: the one walk (ModelView) and the dtype map it yields."""
