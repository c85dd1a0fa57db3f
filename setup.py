"""Packaging for rag_lab; every setting is read from settings.ini (the nbdev way)."""
from configparser import ConfigParser
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    long_description=open('README.md', encoding='utf-8').read() if __import__('os').path.exists('README.md') else '',
    long_description_content_type='text/markdown',
    keywords=cfg.get('keywords', '').split(),
    classifiers=['Programming Language :: Python :: 3.11', 'License :: OSI Approved :: Apache Software License',
                 'Intended Audience :: Science/Research'],
    project_urls={'Source': cfg['git_url']},
    author=cfg['author'],
    author_email=cfg['author_email'],
    license='Apache Software License 2.0',
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=['rag_lab', 'rag_lab.*']),
    include_package_data=True,
    package_data={'rag_lab': ['paper_tables/*/*.csv']},
    install_requires=cfg.get('requirements', '').split(),
    extras_require={'dev': cfg.get('dev_requirements', '').split(), 'llm': cfg.get('llm_requirements', '').split()},
    python_requires='>=' + cfg['min_python'],
    zip_safe=False,
    entry_points={
        'console_scripts': cfg.get('console_scripts', '').split(),
        'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
    },
)
