"""The Flower app: ServerApp, ClientApp and the pieces they use."""
