"""The test suite, a package so that every test module and helper has one dotted name
(``tests.core.test_page_pool``, ``tests.support.tiny_engine``) from the repository root."""
