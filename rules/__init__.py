"""kvguard.rules"""
