"""python -m tiny_zero.checkpoint consolidate PATH OUT.pt"""
from .consolidate import main

main()
