"""Regions (`topology=regions`, docs/fleet.md#regions): which partitions form a region, the
wide-area leg of a region's update, and (deployment) the regional aggregator."""
