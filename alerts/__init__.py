"""kvguard.alerts"""
