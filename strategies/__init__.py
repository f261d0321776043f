"""Our Flower strategies and the tensor maths they share."""
