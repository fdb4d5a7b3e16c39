"""quickstart-dp: Flower's quickstart-pytorch, differentially private with dpfl."""
